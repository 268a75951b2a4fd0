"""How each mode computes per-sample results from what the controller captured.

``names.py`` the modes and loss reductions; ``layer_call.py`` one captured layer call and its
per-sample gradients from its sampler; the two strategies, each answering a parameter's per-sample
norms and ``sum_i c_i g_i`` for given clip factors: ``instantiate.py`` (per-sample gradients
instantiated: "hooks", "functorch", "ew") and ``book_keeping.py`` ("bk", "ghost"); what both use:
``unit_rows.py`` (rows zeroed, summed or grouped by privacy unit) and ``precision.py`` (float32
matmuls at full precision); ``functorch.py`` the torch.func replay of a layer without a sampler;
``expanded_weights.py`` torch's own ("ew"); ``linear_head.py`` the replay of a router-like layer;
``stacked_calls.py`` small calls of one layer configuration sampled as one; ``buffers.py`` the CPU
memory lent to per-sample gradients; ``auto.py`` ``grad_sample_mode="auto"``.
"""
